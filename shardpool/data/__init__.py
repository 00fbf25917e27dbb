"""shardpool.data: a run's datasets, from JSON(L) files to the rows every stage trains on.

It owns reading dataset files (:mod:`.reading`), checking the row formats (:mod:`.formats`;
conversations: :mod:`.conversations`), tokenizing and masking (:mod:`.tokenizing`; conversations
through their chat template: :mod:`.chat`), padding and packing (:mod:`.packing`), cutting the
train and eval splits (:mod:`.prepare`), the prepared-data file stages load
(:mod:`.prepared_file`), the step plan of row indices (:mod:`.steps`), and the rows
`shardpool validate --show` prints with their trained text marked (:mod:`.show`); :mod:`.rows`
holds the shapes they pass along.

It may import torch, transformers (the tokenizer) and safetensors, and from shardpool only
``shardpool.config``, ``shardpool.errors`` and ``mesh.files``; nothing above it. Import each name
from the module that defines it: this package re-exports nothing.
"""
