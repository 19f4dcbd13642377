module rlpacer.local/pause

go 1.22
