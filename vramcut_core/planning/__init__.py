"""The plans: pure data and free functions from units' figures to a plan under a budget.

``plan`` (the budgeted segment plan), ``budget`` (the widget's GiB and every budget message),
``residency`` (residency chosen by time), ``timeline`` (the step time a plan predicts),
``placement`` (a plan across several devices, one budget each), ``planner`` (a module's units
turned into plans) and ``report`` (the plan as text and JSON). Nothing here runs a forward or
touches device memory."""
