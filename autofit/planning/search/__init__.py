"""The search over configurations: the space, Optuna's study and its evaluation, and the checkpoint knapsack."""
