"""The frontend's parts around the core: the input processor (validate, tokenize), the output processor
(detokenize, stop strings, outputs) with its per-request state (`sequence`), and the stream a server reads
a request's outputs from (`request_stream`)."""
