"""A node: runs a span of a model's layers behind `POST /forward`."""
