"""The contract every step of the parallelisation keeps, below every feature folder so that each feature exports its
own step (`contract`: `Step`, `Planning`, `Applying` and the context types). The ordered list of steps and its two
walks are `lightning_dpar.parallel.parallelize`."""

__all__: list[str] = []
