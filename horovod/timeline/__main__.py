from horovod.timeline.summary import main

raise SystemExit(main())
