"""The run: configuration, the command line, Ray placement of the actors, and the training loop's driver.

The top layer: it may import actors/, learner/ and rewards/; nothing imports it except for config types.
"""
