"""Protocol handler plugins, one package per wire protocol."""
