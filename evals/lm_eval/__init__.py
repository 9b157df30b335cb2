"""lm-eval 0.4.x bridge: any lm-eval task on any ERNIE5 sub-model, from the command line or a sweep.

One module per job:

* :mod:`evals.lm_eval.model`: the LM adapter (:class:`~evals.lm_eval.model.Ernie5LM`, model ``ernie5``);
* :mod:`evals.lm_eval.cli`: ``ernie5 lm-eval``, lm-eval's command line;
* :mod:`evals.lm_eval.task_yaml`: a suite's task folder read as data;
* :mod:`evals.lm_eval.sandbox`: task code only with consent, templates in Jinja's sandbox;
* :mod:`evals.lm_eval.unit`: a suite's ``lm_eval`` entry as sweep units;
* :mod:`evals.lm_eval.common`: lm-eval's version, the task-code flags, the bridge's user error.

Suites are data only: a suite's task folder must lie inside the suite's folder or the shipped
``suites/lm_eval``; task code (``!function``, ``unsafe_code``) runs only with ``--confirm-run-unsafe-code``
(``ernie5 sweep`` / ``nightly``) or lm-eval's ``--confirm_run_unsafe_code`` (``ernie5 lm-eval``), and every
file of the folder enters the unit's fingerprint. Nothing is downloaded: importing the package sets the
Hugging Face offline switches unless the caller set them.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
