"""What both model services need: loading a model, the session cache store, logits processing, the
session-stream servicer and the server's start-up."""
