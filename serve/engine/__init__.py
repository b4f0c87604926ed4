"""The serving engine: batch state, scheduling and sampling around the model forward."""
