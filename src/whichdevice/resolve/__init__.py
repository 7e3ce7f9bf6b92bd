"""resolve_device(): the arguments checked, the deciders run in order, the memo, and the Resolution
that hands the answer over (model_kwargs, pipeline_kwargs, training_kwargs, explain, to_dict).

May import: every folder above this one in the layer order (core/ ... tuning/).
"""
