package extender

import "k8s.io/apimachinery/pkg/labels"

func labelsEverythingSelector() labels.Selector { return labels.Everything() }
