"""Protocol frontends (HTTP, gRPC) and the server lifecycle."""
