"""What every process shares: the engine config, sampling parameters, the wire protocol, ZMQ plumbing."""
