"""Generated code for the hilum gRPC contracts (see ``proto/generate.py``)."""
