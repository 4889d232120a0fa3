"""Adapters to transformers, PEFT, Accelerate and TRL: each builds a TrainStreamConfig and calls wrap."""
