"""Analysis and reporting above the experiment: trace explain and timelines, attention plots, head
diversity, the HTML report. Nothing in the core imports it."""
