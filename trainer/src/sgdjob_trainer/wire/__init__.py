"""The contract between the trainer and its controllers (operator, local runner), free of torch.

Both sides import these definitions; neither writes the other's names or rules by hand:
- `launch`: how a controller starts trainers (the run-config file, torchrun's options);
- `metrics`: the Prometheus names on GET /metrics;
- `status`: the GET /status document;
- `control`: the POST /control command and its merge rule.
"""
