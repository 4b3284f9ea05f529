"""[driver] The Params of TorchEstimator and TorchModel: one table (:mod:`.table`), the
families generated from it (:mod:`.columns`, :mod:`.training`, :mod:`.runtime`, written by
:mod:`.codegen`), and the classes that put them together (:mod:`.base`)."""
