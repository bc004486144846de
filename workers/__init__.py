"""The science: model adapters, calibration, scoring, grouping, conversion, distillation, evaluation.

Workers take plain inputs and return plain records; they never import the orchestrator or the DB.
"""
