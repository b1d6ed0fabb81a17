"""hydrafl.proto: the coordinator <-> site wire format and its generated stubs."""
