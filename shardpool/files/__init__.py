"""The launcher's file server and its client: how a stage on another member reads inputs and sends results.

It owns the server (:mod:`.server`: byte ranges with SHA-256, verified uploads, a bearer secret)
and the client (:mod:`.client`: ``RemoteFiles``, a verified, content-addressed-cache byte source).
It may import only mesh, shardpool.contract, shardpool.config and shardpool.errors: no torch, so it
moves and checks bytes only; turning them into tensors is shardpool.model.weights' job.
"""
