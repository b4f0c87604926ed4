"""Independent float64 numpy references used as test oracles."""
