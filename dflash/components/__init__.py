"""The parts a pipeline is built from, each independent of how a command runs: the block pass and its loss
(`loss`), the metrics window (`metrics`), counted FLOPs (`flops`), float8 linear layers (`float8`), checkpoint
step directories (`checkpoint`) and the export for serving (`export`)."""
