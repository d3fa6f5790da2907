"""Evaluation: the `Evaluator` the trainer's evals and `dflash eval` share (`evaluate`), real speculative decoding
(`speculative`) and the published benchmark suites (`suites`)."""
