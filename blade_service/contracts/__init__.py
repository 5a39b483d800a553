"""The contracts layer: what every other package agrees on, importing nothing of ours and no torch.

`contracts.methods` (method names, configs, presets), `contracts.params` (one validator for a method's
parameters), `contracts.records` (dataset file formats), `contracts.names` (Celery task and queue names),
`contracts.errors` (typed domain errors). import-linter (`make lint`) keeps it below every layer.
"""
