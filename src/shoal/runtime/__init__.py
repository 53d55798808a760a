"""Process runtime: launcher detection, rendezvous, topology and the process-wide context."""
