"""Site agent: enrolment, connection, runs the ClientApp in-process, site policy, TLS."""
