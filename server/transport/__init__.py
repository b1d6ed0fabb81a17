"""The coordinator's gRPC side: the service sites call, the Flower Grid over its store, mailboxes, reply
checks, listener limits and TLS."""
