"""The site's shared records: node health, node failures, rank stacks and a rank's last words.
Both sides: the ranks write them on the nodes, the login side reads them (`hpcdist nodes`,
`hpcdist stacks`, the summary of a job that failed)."""
