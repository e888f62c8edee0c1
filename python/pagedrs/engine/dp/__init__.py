"""Data parallelism: several engine cores, each a whole replica of the model, behind one frontend (`client`),
the router that picks each request's replica (`router`), several API server processes over the same cores
(`frontends`). The offline engine over them is `pagedrs.engine.dp_llm_engine`."""
