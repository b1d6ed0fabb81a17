"""Site agent: enrolment, connection, runs the ClientApp in-process (see issue 4)."""
