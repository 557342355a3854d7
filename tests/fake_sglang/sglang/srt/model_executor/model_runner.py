"""Old home of LocalSerializedTensor. 0.5.21 no longer exports it here (note 7), so
`from sglang.srt.model_executor.model_runner import LocalSerializedTensor` fails with
ImportError, as it does for older verl against the real package."""
