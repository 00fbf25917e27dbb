"""WireGuard on this machine: keys, the backend interface (backend) with its kernel (pyroute2)
and userspace (wireguard-go over UAPI) implementations, the choice between them (choice), the
interface's links and addresses, and wg-quick files. May import mesh.http and the base modules,
never mesh.control, mesh.node or mesh.cli.
"""
