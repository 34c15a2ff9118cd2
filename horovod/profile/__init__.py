"""``horovod.profile``: find the communication bottleneck before choosing a remedy
(issue 35's profiler): ``python -m horovod.profile`` under horovodrun (``__main__``), the
measurements it takes inside the job (``measure``) and the alpha-beta model that predicts step
time and scaling efficiency at other sizes for each method (``costs``). docs/communication.md.

Must not touch: the engine (public API only).
"""
