"""distrun-rpc: RPC and parameter-server strategies for distrun."""
