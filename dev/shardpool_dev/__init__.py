"""shardpool's development kit: the benchmark library (:mod:`shardpool_dev.bench`) and the
network-namespace lab (:mod:`shardpool_dev.lab`). Not part of the installed shardpool package."""
