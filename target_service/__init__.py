"""The target service: hosts the large model and verifies K-token blocks in one forward pass."""
