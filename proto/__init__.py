"""hydrafl.proto: coordinator <-> site protocol and generated stubs (see issue 4)."""
