"""The queue between the processes, torch-free: the Celery app (`app.py`, configured from `Settings`) and the
functions that publish work by task name (`dispatch.py`). The API publishes through it and never imports the
worker; the worker registers its tasks on the same app (`worker/celery_app.py`)."""
