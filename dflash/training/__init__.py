"""`dflash train`'s pipeline: the `Trainer` (`trainer`), what it is given (`sources`: where batches and target
features come from; `reducers`: how the ranks' steps meet), the drafter it builds (`drafter_setup`), its CUDA-graph
step (`step_graph`), its checkpoint policy (`checkpointer`), the final export for the trackers (`tracker_export`),
one process run to its end (`run`), and under torchrun the ranks (`ranks`) and the worker's entry point (`worker`)."""
