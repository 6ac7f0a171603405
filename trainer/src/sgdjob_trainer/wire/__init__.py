"""The contract between the trainer and its controllers (operator, local runner), free of torch.

Both sides import these definitions; neither writes the other's names or rules by hand.
"""
