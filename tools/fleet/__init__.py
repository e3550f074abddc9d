"""A fleet that gains a slower node, and one of unequal nodes: planned against controls.

``zctl bench fleet`` (``python -m tools.fleet``) checks two claims on local clusters of
SmolLM2-135M INT4, a core each (tools/plan's measuring, tools/harness's load):

- a slower node never makes it slower: a node held to a quarter of a core (a cgroup CPU
  quota), or one behind a 50 ms link, joins a serving 2-node cluster; its one-stream and
  8-stream tok/s stay within 5% of the same 2-node cluster without it, while a control
  that gives the new node its share (an explicit placement) gets slower;
- heterogeneity pays: on two nodes, one held to a quarter of a core, the planner's split
  is at least 1.3x faster than the equal split (an explicit placement).

Every arm's cluster runs side by side (idle but for the one measured) and the arms are
measured in turns, round after round, so that the machine's load falls on them alike.

``cases`` holds the arms and the comparisons (pure), ``measure`` starts the arms and runs
the rounds, ``report`` the ratios, the targets and the table, ``cli`` the command line.
"""
