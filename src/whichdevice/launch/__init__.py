"""How this process was launched and what accelerate will do with it: the launcher's variables, the
process group, leftovers of other launches, accelerate's own settings, TrainingArguments' device keywords.

May import: core/, hardware/.
"""
