"""What all three specdec servers share: wire codec, errors, server bootstrap, logging, metrics."""
