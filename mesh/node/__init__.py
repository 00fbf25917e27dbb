"""This machine as a mesh member: its saved settings, bringing the interface up and down, the
roster sync daemon, reachability probes, and the Python API the training side reads (api). May
import mesh.control, mesh.wireguard, mesh.http and the base modules, never mesh.cli.
"""
