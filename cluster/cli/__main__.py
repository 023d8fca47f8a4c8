from cluster.cli.commands import main

raise SystemExit(main())
