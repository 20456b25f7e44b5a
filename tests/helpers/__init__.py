"""Helpers the test modules share, by subject (test modules never import each other): a running server
(`server`), the serving engine on a tiny model (`engine`), small checkpoints written on the fly (`checkpoints`),
the multi-process sharded cases (`multiprocess`), an FP8 store's tolerance on the GPU (`fp8`) and random inputs
drawn without compiling (`data`). No module here holds tests or fixtures; pytest collects none."""
