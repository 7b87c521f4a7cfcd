"""An OpenAI-compatible server for a VLM: ``python -m ascend_vlm serve`` (:mod:`.cli`).

One engine thread (:mod:`.engine`) drives a continuously batched
:class:`~ascend_vlm.batching.BatchGenerator`; a FastAPI app (:mod:`.app`) answers OpenAI's
``/v1/chat/completions`` (JSON or server-sent events), ``/v1/models``, ``/health`` and a
Prometheus ``/metrics`` (:mod:`.metrics`), with OpenAI's error objects (:mod:`.errors`),
request limits and image rules (:mod:`.limits`, :mod:`.images`), an optional bearer key and a
body-size limit (:mod:`.middleware`), and a drain at SIGTERM (:mod:`.server`).

Why FastAPI + uvicorn and not transformers' serving module (``transformers/cli/serving``,
``transformers serve``): that module has no public extension point for another engine. Its
``EngineClient.run_engine`` loads the model with its own ``ModelLoader`` in a process of its
own and picks one of its two runners itself (``CBGenerateRunner`` for LLMs,
``GenerateRunner``, one request at a time, for everything else: "Only LLMs support continuous
batching"); ``build_server`` takes its own handler classes, which all call that engine. Hosting
our batch generator there would mean replacing private runner classes in its engine process.
Its answers also miss parts of the OpenAI contract this server keeps (its errors are
``{"detail": ...}``, not OpenAI's error object). FastAPI + uvicorn are what that module itself
runs on, so the server stands on the same stack, with our engine behind it.

Needs the ``serve`` extra (``pip install ascend_vlm[serve]``: fastapi, uvicorn,
prometheus-client).
"""
