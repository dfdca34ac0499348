"""The draft service: hosts the small model and proposes K tokens per step."""
