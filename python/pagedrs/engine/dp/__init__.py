"""Data parallelism: several engine cores, each a whole replica of the model, behind one frontend (`client`),
the router that picks each request's replica (`router`), several API server processes over the same cores
(`frontends`) and the offline engine over them (`llm_engine`)."""
