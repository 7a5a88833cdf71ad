"""LEAP: length-predicting scheduler.

A linear head on one decoder layer's prefill hidden state predicts each
request's output length (in log space); recursive least squares corrects the
head online from the true lengths; the scheduler serves the shortest predicted
remaining work first, with an aging bound against starvation.

Algorithm modules (no vLLM import, unit-testable alone):

- :mod:`vllm_ext.leap.config` -- ``LeapConfig``, the one frozen config.
- :mod:`vllm_ext.leap.predictor` -- ``LinearLengthModel``: ridge calibration,
  prediction with uncertainty, RLS updates, atomic ``.npz`` persistence.
- :mod:`vllm_ext.leap.policy` -- ``LeapPolicy``: serving order and preemption
  victim over plain ``RequestView`` records.
- :mod:`vllm_ext.leap.quality` -- predictor quality metrics (MAE of log
  length, Kendall's tau).

This package file imports nothing, so importing a submodule never pulls in the
vLLM adapters.
"""
