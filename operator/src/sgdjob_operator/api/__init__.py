"""The SGDJob API: models, validation and the CRD generated from them."""
