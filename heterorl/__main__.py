from heterorl.cli import main

raise SystemExit(main())
