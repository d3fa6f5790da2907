"""The process runtime every command shares: stop signals (`stop`), the torchrun launcher (`torchrun`), the ranks'
topology, transfers, target stages and setup barrier (`topology`, `transfer`, `stages`, `setup_barrier`; docs/topology.md),
hang evidence (`stacks`), the supervisor's watchdog (`notify`), failure classes (`failures`), run records and
experiment trackers (`observability`, `trackers`), multi-node presence (`multinode`) and `dflash doctor` (`doctor`)."""
